"""Tests of dissoc.device: device batches, device landings and pairs, hash partitioning on the device."""
