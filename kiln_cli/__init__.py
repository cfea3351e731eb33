"""The `kiln` command (docs/ARCHITECTURE.md#packages): it stands above what it starts (`kiln serve`
runs the api, `kiln worker` the worker, `kiln train local` the library), so nothing below it
imports it. Each command imports torch only when it runs."""
