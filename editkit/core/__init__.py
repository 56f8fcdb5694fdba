"""The method itself, independent of models and data: linearized task models (``linearize``),
the tauJp penalty and its unlabeled sources (``taujp``), how inputs of each modality are batched
(``batching``), the fine-tuning modes and the registry that extensions use to announce themselves; and the
pinned downloadable artifacts (``artifacts``) that both models and data come from, which is why they live
below both. Nothing here imports a layer above the settings, errors and utilities."""
