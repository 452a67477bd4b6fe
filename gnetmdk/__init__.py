"""gnetmdk: quantization-aware training of object detectors for Gyrfalcon Lightspeeur-class CNN
accelerators and standard int8 runtimes, from float training to an integer model proven equal to the
trained one (README.md; the packages and their floors: docs/architecture.md)."""
