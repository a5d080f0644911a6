"""Yours: what a forker edits. Datasets (``data/``), networks (``nets/``) and the
LightningModule (``model.py``). The template's machinery (``src/template/``) never imports this
package; the entry points hand these to it."""
