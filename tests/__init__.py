"""The test suite: unit/ (one process), distributed/ (real ranks on gloo), e2e/ (whole runs of the
commands, local Slurm clusters), helpers/ (shared by all, imported as tests.helpers.*)."""
