"""The run folder: its layout and atomic writes (artifacts), schemas (schema_io), trace records and
their fast reading (records, tracescan), the seal (integrity, signing, fleetseal), packs (archive),
the writer's lock (folderlock), the seed's layout recognised (seedlayout) and the environment
fingerprint (env). Reads and writes files; never runs an engine or compares runs."""
