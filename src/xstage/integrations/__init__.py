"""Running xstage inside the model libraries people already serve with.

- `xstage.integrations.transformers`: an experts backend for transformers' MoE blocks
  (`experts_implementation="xstage"`) and expert parallelism over a torch.distributed group.
- `xstage.integrations.diffusers`: xstage's Ulysses attention inside a diffusers transformer.

Each submodule imports its library on first use and raises one `xstage.errors` line naming the pip extra
(`xstage[transformers]`, `xstage[diffusers]`) when the library is missing or outside the tested range. No
other floor imports these libraries (an import contract), so `import xstage` never needs them.
"""
