"""foxlm.eval: evaluations of foxlm checkpoints (``foxlm eval {loss,niah,recall,gates,harness}``).

- ``loss``: per-token loss L(l) and P(l) = exp(mean L(1..l)) over held-out documents, streamed.
- ``niah``: needle in a haystack (easy / standard), greedy decoding, scored offline.
- ``recall``: multi-query associative recall (``foxlm.data.mqar``) by context length and number of pairs.
- ``gates``: forget-gate decay times, decay matrices and attention maps, and the ACP pruning report.
- ``harness``: lm-evaluation-harness with foxlm registered (``--model foxlm`` / ``--model hf``); needs the
  ``eval`` extra, so it is imported only when used.
"""
