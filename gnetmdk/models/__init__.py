"""Model families (architecture.md, "models/<family>/"): one sub-package per family behind one protocol."""
