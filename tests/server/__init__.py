"""Tests of the servers (dissoc.server and the role servers): what they send, their options, health."""
