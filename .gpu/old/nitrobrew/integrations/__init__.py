"""nitrobrew's losses inside other training frameworks (each imported on its own, with its package).

- ``nitrobrew.integrations.trl``: TRL's ``GKDTrainer`` and ``DistillationTrainer`` with nitrobrew's
  loss (``pip install 'nitrobrew[trl]'``).
- ``nitrobrew.integrations.axolotl``: an Axolotl plugin whose KD loss is ``topk_kl``
  (``pip install 'nitrobrew[axolotl]'``; ``plugins: [nitrobrew.integrations.axolotl.NitrobrewKDPlugin]``).

Nothing here is imported by ``import nitrobrew``.
"""
