"""Alignment: the record format of training iterations, the replay loader, weight comparison and the
alignment command-line options (docs/alignment.md). The trainer's hook that records and replays is
gnetmdk/engine/align_hook.py."""
