"""moeless.predictor: forecasts of each expert's token load d layers ahead: layer-aware gate replicas,
their training and baselines (gate reuse, a from-scratch MLP, a history window, fMoE maps)."""
