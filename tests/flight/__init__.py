"""Tests of dissoc.flight: the Flight control plane, the client's grpc:// locations, its secret and TLS."""
