"""Model families (backbones) and the fixed heads on top of them."""
