"""moeless.model: the model every part uses: MoEModel (non-expert layers + experts by (layer, expert)),
HF MoE loaders, the default model's conversion, the per-expert weight store, routing capture, datasets."""
