"""Tests of docker/: hadolint on the Dockerfiles, and the images built and run (marker docker)."""
