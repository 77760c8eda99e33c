"""The servers the serving benchmarks compare, and how they are started, driven and stopped.

build_llamacpp.sh builds llama.cpp's llama-server from the llama-cpp-python sdist; servers.py
starts it, `pdserve up` or single pdserve components, and runs `pdserve bench` against them.
"""
