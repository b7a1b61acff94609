#!/usr/bin/env bash
# Packaging check: what `pip install fsd-ext` from a source distribution gets must build and run.
#   1. the sdist holds every file under csrc/ (headers and .cu included: setup.py names
#      only the sources this machine's torch can build, MANIFEST.in adds the rest);
#   2. a wheel built from that sdist (not from the tree) installs into a clean venv that shares
#      only torch's site-packages, imports from the venv, and runs accept/sample/divergence.
# Environment: PYTHON (default python3), FSD_PACKAGE_DIR (work dir, default build/package).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
WORK=${FSD_PACKAGE_DIR:-$ROOT/build/package}
rm -rf "$WORK" && mkdir -p "$WORK"
cd "$ROOT"

# from a copy of the working tree's files (tracked or not, minus ignored ones): a stale
# fsd_ext.egg-info/SOURCES.txt in the tree would otherwise feed the sdist files MANIFEST.in lacks
mkdir -p "$WORK/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK/src"
(cd "$WORK/src" && $PY setup.py -q sdist -d "$WORK/dist" > "$WORK/sdist.log" 2>&1) ||
  { cat "$WORK/sdist.log"; exit 1; }
sdist=$(ls "$WORK"/dist/fsd_ext-*.tar.gz)
version=$(basename "$sdist" .tar.gz)
tar tzf "$sdist" | sed -n "s|^$version/||p" | sort > "$WORK/in_sdist.txt"
(cd "$WORK/src" && find csrc LICENSE -type f) | sort > "$WORK/tracked.txt"
missing=$(comm -23 "$WORK/tracked.txt" "$WORK/in_sdist.txt")
if [ -n "$missing" ]; then
  echo "sdist $sdist lacks files of the tree (add them to MANIFEST.in):"; echo "$missing"; exit 1
fi
echo "sdist ok: $(wc -l < "$WORK/in_sdist.txt") files, every csrc/ file included"

$PY -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/wheels" "$sdist"
$PY -m venv --system-site-packages "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --no-deps "$WORK"/wheels/fsd_ext-*.whl
cd "$WORK"  # away from the tree, so `import fsd_ext` cannot find the source checkout
"$WORK/venv/bin/python" - "$WORK/venv" <<'PY'
import sys, torch, fsd_ext
venv = sys.argv[1]
assert fsd_ext.__file__.startswith(venv), f"imported {fsd_ext.__file__}, not the wheel in {venv}"
assert fsd_ext.__version__ not in ("", "unknown"), fsd_ext.__version__
import os  # package data, not a package: the folder transformers loads for custom_generate="<path>"
folder = os.path.join(os.path.dirname(fsd_ext.__file__), "engines", "hf_custom_generate")
assert os.path.isfile(os.path.join(folder, "custom_generate", "generate.py")), f"{folder} missing"
g = torch.Generator().manual_seed(0)
target = torch.randn(3, 5, 1000, generator=g)
draft = torch.randn(3, 4, 1000, generator=g)
drafts = fsd_ext.sample(draft.reshape(-1, 1000), seed=0).reshape(3, 4)
res = fsd_ext.accept(target, draft, drafts, rule="fsd", divergence="js", threshold=0.3, seed=1)
ref = fsd_ext.reference.accept(target, draft, drafts, rule="fsd", divergence="js", threshold=0.3,
                               coin_uniforms=fsd_ext.philox_uniforms(1, 0, 3, 4, purpose="accept"),
                               sample_uniforms=fsd_ext.philox_uniforms(1, 0, 3, 5, purpose="sample"))
assert torch.equal(res.tokens, ref.tokens) and torch.equal(res.num_accepted, ref.num_accepted)
d = fsd_ext.divergence(target[:, :4], draft, kind="kl")
assert d.shape == (3, 4) and torch.isfinite(d).all()
print(f"wheel ok: fsd_ext {fsd_ext.__version__} from {fsd_ext.__file__}, accept == reference")
PY
