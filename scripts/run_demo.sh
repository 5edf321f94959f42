#!/usr/bin/env bash
echo "make demo: the embedded VAPO run arrives with the trainer (issue 5); not available yet." >&2
exit 1
