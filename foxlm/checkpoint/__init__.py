"""foxlm.checkpoint: the one home of checkpoints and run folders (torchtitan's ``components/checkpoint``).

=================  ====================================================================================
``files``          safe filesystem helpers: sha256, JSON with named errors, temporaries, folder swaps
``manifest``       ``manifest.json``: write and verify the sha256 of every file of a folder
``run_folder``     a run's ``out_dir``: its marker, lock, ``train_config.yaml``, checkpoints, the latest one
``weights``        a trained model's weights from a run, checkpoint or ``save_pretrained`` folder
``dcp``            sharded checkpoints (torch.distributed.checkpoint): save, and a reader that runs no code
``checkpointer``   writing training checkpoints atomically; resuming or initializing a run from them
``export``         a checkpoint's model as a Hugging Face ``save_pretrained`` folder (``foxlm export``)
=================  ====================================================================================

Floors: ``files``, ``manifest``, ``run_folder``, ``weights`` and ``dcp`` import nothing of foxlm but each other, so
that ``foxlm.data`` and ``foxlm.models`` use them; ``checkpointer`` and ``export`` build on ``foxlm.models`` and
``foxlm.data`` and are used by ``foxlm.train``. Nothing here imports ``foxlm.train`` or ``foxlm.eval``, and this
file imports no module, so that importing one part loads no other.
"""
