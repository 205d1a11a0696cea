"""Checks on a Ray cluster (`--ray ADDRESS`): one check per node, accelerator type or resource, each a
pinned Ray task that returns its sealed run folder packed through the object store, and the fleet's
N-way verdict over them in one fleet folder (docs/ray.md). Ray is imported only here, and only when
`--ray` is given; it schedules and transports, the verdict is the fleet's.
"""
