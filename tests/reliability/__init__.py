"""Reliability against hostile and failing peers: bounded memory, no crash, fair sharing (marked ``slow``)."""
