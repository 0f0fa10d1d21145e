"""The zoo: the models a run names (``--model lenet5_caffe``), one module per source, each registering its
models when imported (``make_model``, ``model_names``).

* ``generic``: general-purpose models (LeNet-5-Caffe, small CNNs and MLPs for tests);
* ``spafl``: the SpaFL paper's CIFAR models (``cnn7``, ``resnet18_narrow``, ``vit_small``);
* ``feddrop``: the FedDrop paper's models (Tables 6-8);
* ``fsl``: the FSL paper's models (Table 3).
"""
from fedjax_sparse.models.zoo import generic, spafl, feddrop, fsl  # noqa: F401  (registers the models)
