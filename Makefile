# Two commands do all the set-up (README): `make train` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup train test benchmark notebook tensorboard clean gpu-check

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

train: setup            ## train on the embedded data set (or: make train ARGS="batch_size=2")
	$(PY) train_unet.py $(ARGS)

test: setup             ## the test suite (what CI runs)
	$(PY) -m pytest -q tests $(ARGS)

gpu-check: setup        ## every CUDA path on this machine's GPU(s), a short report (needs a GPU; ARGS="skip=compile")
	$(PY) tools/gpu_check.py $(ARGS)

benchmark: setup        ## the FP32-vs-BF16 matrix (or: make benchmark ARGS="configs=fp32,bf16 epochs=4")
	$(PY) train_unet.py benchmark $(ARGS)

notebook: setup         ## Jupyter on notebooks/ (another run: make notebook RUN_DIR=checkpoints/previous/...)
	$(VENV)/bin/jupyter notebook --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(ARGS)

tensorboard: setup      ## TensorBoard on every run under checkpoints/ (benchmark configurations too)
	$(VENV)/bin/tensorboard --logdir checkpoints $(ARGS)

clean:                  ## remove outputs (not the venv)
	rm -rf checkpoints predictions .pytest_cache
