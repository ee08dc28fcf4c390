"""Tests of the command line (dissoc.cli): serve and get end to end, the progress bar, --flight."""
