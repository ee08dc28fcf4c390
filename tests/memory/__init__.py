"""Tests of dissoc.memory: shared-memory arenas, UCX RMA, private per-connection arenas."""
