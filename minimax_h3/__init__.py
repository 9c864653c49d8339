"""MiniMax-H3 itself, apart from the serving: the contract between the stages (`contract`), the model code the
stages run (`dit`, `text`, `vae`), the kernels behind its layers (`kernels`), its files (`files`) and media rules
(`images`, `media`, `mux`, `labels`). Nothing here imports a stage package; `stagekit` (the model-agnostic serving)
never imports this package."""
