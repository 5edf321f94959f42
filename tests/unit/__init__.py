"""Tests of one piece at a time, in one process (no process group)."""
