"""The block-level kinds: lookup, grant, publish, release (`kvd.engine.holds`).

For engines that keep their own block tables (vLLM's scheduler and its
workers): each handler calls the session's engine once and returns the
result map as it goes on the wire, or the engine's `Refusal`. A request's
keys are bounded like its tokens: ``keys * block_size`` tokens count
against `[security]`'s per-request limit (TOO_LARGE).
"""

from __future__ import annotations

from kvd_client import wire

from kvd.engine import Refusal
from kvd.errors import RequestError
from kvd.server.context import Outcome, SessionCall
from kvd.server.security import RequestLimits
from kvd.server.sequences import block_bytes
from kvd.server.tiers import PendingPromotion, Tiers

__all__ = ["HoldHandlers"]


class HoldHandlers:
    """The hold kinds' handlers, under ``limits``; ``tiers`` copies what a publish caches."""

    def __init__(self, limits: RequestLimits, tiers: Tiers) -> None:
        self.limits = limits
        self.tiers = tiers

    def _check_blocks(self, n: int, call: SessionCall) -> None:
        """TOO_LARGE when ``n`` blocks hold more tokens than one request may name."""
        limit = self.limits.max_tokens
        if limit and n * call.engine.block_size > limit:
            raise RequestError(
                wire.Code.TOO_LARGE,
                f"{n} blocks of {call.engine.block_size} tokens in one request (limit {limit})",
            )

    def lookup(self, req: wire.LookupRequest, call: SessionCall) -> Outcome | PendingPromotion:
        """A lookup, or (held, the run continuing into tier 1, not in a batch)
        the promotion to make first: the reply waits for it, no one else does."""
        self._check_blocks(len(req.keys), call)
        if req.hold and call.engine.tier is not None:
            job = self.tiers.ask(req, call, self.lookup_now)
            if job is not None:
                return job
        return self.lookup_now(req, call)

    def lookup_now(self, req: wire.LookupRequest, call: SessionCall) -> Outcome:
        """The lookup itself (after its promotion, if any)."""
        r = call.engine.lookup(call.session.id, req.keys, hold=bool(req.hold))
        if isinstance(r, Refusal):
            return r
        return {
            "cached": r.cached,
            "blocks": block_bytes(r.blocks) if r.blocks else b"",
            "hold": r.hold_id,
        }

    def grant(self, req: wire.GrantRequest, call: SessionCall) -> Outcome:
        self._check_blocks(req.n, call)
        g = call.engine.grant(call.session.id, req.n)
        if isinstance(g, Refusal):
            return g
        return {"hold": g.hold_id, "blocks": block_bytes(g.blocks)}

    def publish(self, req: wire.PublishRequest, call: SessionCall) -> Outcome:
        refusal = self.limits.check_request(req) if self.limits.max_tokens else None
        if refusal is not None:
            raise refusal
        n = call.engine.publish(
            call.session.id,
            req.hold,
            req.blocks.tolist(),
            req.keys,
            tokens=req.tokens,
            parent=req.parent,
        )
        if n and call.engine.tier is not None:
            self.tiers.noted(call)
        return {"published": n}

    def release(self, req: wire.ReleaseRequest, call: SessionCall) -> Outcome:
        blocks = None if req.blocks is None else req.blocks.tolist()
        return {"released": call.engine.release(call.session.id, req.hold, blocks)}
