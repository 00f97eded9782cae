"""Caches: the state pool, slot/page allocators, prefix cache and session pins."""
