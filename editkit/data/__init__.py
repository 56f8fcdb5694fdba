"""Dataset adapters: packaged offline data (``packaged``), generic natural-image crops
(``natural``) and the download cache they share (``cache``).

Submodules are imported on demand; importing this package stays cheap.
"""
