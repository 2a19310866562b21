"""The KV-cache manager core: specs, layout, hashing, sequences, the block pool, per-kind rules,
retention and the manager facade. Standard library only."""
