"""The trace: schema, storage, statistics, canonical mapping of shards."""
