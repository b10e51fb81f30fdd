"""A real inference client of kvd: a tiny Llama-like model whose attention lives in the pool."""
