"""Kiln's shared ground (docs/ARCHITECTURE.md#packages): the job store, settings, the broker client
and redaction, which the api, the worker and the `kiln` command (`kiln_cli`) all stand on."""
