"""Model families (backbones) and the fixed heads on top of them: the registries ``BACKBONES`` and ``HEADS``.

The built-in families and heads register themselves in their own modules, imported
below; heavy libraries (open_clip, the EfficientNet packages, scikit-learn) are
imported only inside the builders.
"""

from editkit.core.registry import Record, Registry

BACKBONES: Registry[Record] = Registry("backbone family")
"""Family name -> record whose ``build(**options)`` returns a :class:`~editkit.models.backbone.Backbone`
(options: the scenario's ``[backbone]`` table minus ``family``); its ``check(**options)`` lists missing weights."""
HEADS: Registry[Record] = Registry("head kind")
"""Head kind -> record whose ``build(backbone, task, dataset, seed, **options)`` returns one task's fixed head
(options: the ``[heads]`` table minus ``kind``)."""

from editkit.models import causal_lm, clip, efficientnet, heads, seq2seq, text_encoder, torchvision_models  # noqa: E402,F401  (built-in extensions register themselves)
