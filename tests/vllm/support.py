"""Helpers of the vLLM tests: a tiny random-weight Llama, and vLLM in a subprocess.

No model can be downloaded here, so `tiny_llama` builds one with
transformers (``LlamaConfig`` + ``save_pretrained``, deterministic seed) and
caches it beside the vLLM venv, keyed by its config:

    ${KVD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvd}/models/llama-<sha256(config)[:12]>

`run_vllm` runs ``runner.py`` (one ``LLM`` per process, as separate vLLM
deployments on one node are) and returns its JSON: per request the greedy
output token ids, ``num_cached_tokens`` and timings, and the start-up time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RUNNER = HERE / "runner.py"
DATA = HERE / "data"


def cache_dir() -> Path:
    """The cache shared with ``scripts/vllm-env.sh`` (outside the clone)."""
    if os.environ.get("KVD_CACHE_DIR"):
        return Path(os.environ["KVD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvd"


@dataclass(frozen=True)
class LlamaSpec:
    """The config of a random-weight Llama; the defaults are the tests' tiny one (~1 M params).

    2 layers, 4 query heads and 2 KV heads of 64 dims: a KV block of 32 tokens
    is 2 x 2 x 32 x 64 floats per layer.
    """

    num_hidden_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    # Wider than transformers' 0.02, so greedy's top two logits stay far
    # apart relative to float noise (random weights give flat logits).
    initializer_range: float = 0.1
    seed: int = 0
    dtype: str = "float32"

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def tiny_llama(spec: LlamaSpec = LlamaSpec()) -> Path:
    """The model directory for ``spec``: built once (a few seconds), then reused."""
    target = cache_dir() / "models" / f"llama-{spec.key}"
    if (target / ".complete").exists():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = asdict(spec)
    seed, dtype = fields.pop("seed"), fields.pop("dtype")
    config = LlamaConfig(
        **fields,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "kvd-spec.json").write_text(json.dumps(asdict(spec), indent=1) + "\n")
        (tmp / ".complete").touch()
        try:
            tmp.rename(target)
        except OSError:  # another process built it first
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class VllmFailed(AssertionError):
    """The runner subprocess exited non-zero; the message holds its stderr tail."""


class VllmRun:
    """A runner subprocess in flight (`start_vllm`); `result` waits for its JSON."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str], timeout: float) -> None:
        self.timeout = timeout
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        self._spec_path = f.name
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in result)
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), f.name],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=ROOT,
            # Its own process group: a test can kill vLLM and its engine core at once.
            start_new_session=True,
        )

    def result(self) -> dict[str, Any]:
        try:
            stdout, _ = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        finally:
            os.unlink(self._spec_path)
        self._stderr.seek(0)
        stderr = self._stderr.read()
        self._stderr.close()
        if self.proc.returncode != 0:
            raise VllmFailed(f"vLLM runner exited {self.proc.returncode}:\n{stderr[-6000:]}")
        result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
        result["stderr"] = stderr
        return result


def start_vllm(
    model: Path,
    prompts: list[list[int]],
    *,
    max_tokens: int = 8,
    block_size: int = 32,
    kv_transfer_config: dict[str, Any] | None = None,
    kv_events_config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
    **extra: Any,
) -> VllmRun:
    """Start one vLLM process on ``prompts`` (token ids; one request after another, greedy).

    ``result()`` returns ``{"startup_s": s, "requests": [{"output_token_ids": [...],
    "num_cached_tokens": n, "wall_s": s, "ttft_s": s, "first_token_latency_s": s}],
    "stderr": text}``. ``block_size`` must be a multiple of 32 (the CPU attention
    backend's rule). ``kv_transfer_config`` and ``kv_events_config`` are the
    keyword arguments of vLLM's ``KVTransferConfig`` and ``KVEventsConfig``.
    ``extra`` goes into the runner's spec (``cache_salts``, ``dtype``,
    ``reset_prefix_cache``, ``linger_s``, ``enable_prefix_caching``, ``max_model_len``,
    ``llm_kwargs`` (more ``LLM`` arguments), ``together`` (every prompt at once through
    the engine's step loop, with ``abort`` ids aborted after ``abort_after_steps``)).
    """
    if block_size % 32:
        raise ValueError(
            f"the CPU backend takes block sizes that are multiples of 32: {block_size}"
        )
    spec = {
        "model": str(model),
        "prompts": [list(map(int, p)) for p in prompts],
        "max_tokens": max_tokens,
        "block_size": block_size,
        "kv_transfer_config": kv_transfer_config,
        "kv_events_config": kv_events_config,
        **extra,
    }
    proc_env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: plenty for these models
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    return VllmRun(spec, proc_env, timeout)


def run_vllm(model: Path, prompts: list[list[int]], **kwargs: Any) -> dict[str, Any]:
    """`start_vllm` and wait for its result."""
    return start_vllm(model, prompts, **kwargs).result()


def example_connector(storage: Path) -> dict[str, Any]:
    """``kv_transfer_config`` of vLLM's shipped ``ExampleConnector`` (files under ``storage``)."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def kvd_shared(address: str) -> dict[str, Any]:
    """``kv_transfer_config`` of `KvdConnector` in shared mode (the pool is vLLM's KV buffer)."""
    return {
        "kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd_client.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvd_address": address, "mode": "shared"},
    }


def kill_once_holding(run: VllmRun, holds: Callable[[], int], timeout: float = 240) -> None:
    """SIGKILL ``run``'s process group once ``holds()`` (kvd's count) is above 0."""
    deadline = time.monotonic() + timeout
    while holds() == 0:
        assert run.proc.poll() is None, "vLLM ended before it held anything"
        assert time.monotonic() < deadline, "no hold seen"
        time.sleep(0.1)
    os.killpg(run.proc.pid, signal.SIGKILL)
    try:
        run.result()
    except VllmFailed as exc:
        assert "exited -9" in str(exc), exc
    else:
        raise AssertionError("vLLM was not killed")


def prompt_tokens(n: int, salt: int = 0, vocab: int = LlamaSpec.vocab_size) -> list[int]:
    """``n`` deterministic token ids in ``[3, vocab)`` (0-2 are pad/bos/eos)."""
    return [3 + (i * 7919 + salt * 104729) % (vocab - 3) for i in range(n)]


#: A daemon whose runtime pools get a host tier of 4x their blocks (``start_kvd``'s overrides).
TIERED = {"memory.runtime_pool_tier_factor": "4"}


def tier_stats(address: str, pool: str) -> dict[str, Any]:
    """The ``tiers`` stats of ``pool``'s host tier."""
    from kvd_client import Client

    with Client.connect(address, pool=None) as kv:
        tier: dict[str, Any] = kv.stats()["tiers"][pool]
        return tier


def evict_from_the_pool(address: str, pool: str) -> None:
    """Once the tier has every cached block of ``pool``, fill the whole pool with a
    fresh prompt (a kvd client's allocate), so that nothing cached is left in it."""
    from kvd_client import Client

    deadline = time.monotonic() + 60
    with Client.connect(address, pool=pool) as kv:
        cached = kv.stats()["blocks"][pool]["evictable"]
        while tier_stats(address, pool)["demotions"] < cached:
            assert time.monotonic() < deadline, tier_stats(address, pool)
            time.sleep(0.1)
        assert kv.layout is not None
        fresh = prompt_tokens(kv.layout.num_blocks * kv.layout.block_size, salt=99)
        kv.allocate("evict", fresh).free()
