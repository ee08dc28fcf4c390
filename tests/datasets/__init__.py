"""Tests of dissoc.datasets: the kinds of dataset a server serves and the catalog."""
