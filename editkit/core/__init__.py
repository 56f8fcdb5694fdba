"""The method itself, independent of models, data and files: linearized task models (``linearize``),
the tauJp penalty and its unlabeled sources (``taujp``), how inputs of each modality are batched
(``batching``), the fine-tuning modes and the registry that extensions use to announce themselves.
Nothing here imports another editkit layer."""
