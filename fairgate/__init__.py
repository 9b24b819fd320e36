"""fairgate-package: fairgate

The product layer, on top of the stack: the `fairgate` command (`fairgate.cli`), the whole-file
configuration (`fairgate.config`: fairgate.yaml, `FairgateConfig`) and the subcommands that read
it. Packages depend downward only: fairgate -> gateway -> engine, tenants -> protocol; engine ->
kernels; tuner -> engine, protocol. Nothing below imports fairgate.
"""
