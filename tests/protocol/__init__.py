"""Tests of dissoc.protocol: the Dissociated IPC state machines, bytes in and events out (pure)."""
