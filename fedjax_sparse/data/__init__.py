"""Datasets (original file formats or your own arrays), partitions and stacked client data.

The front door's three: ``from_arrays`` (your arrays, with your client ids or a partition spec),
``load`` (a built-in data set by name, or ``npz:PATH``) and ``partition`` (a loaded ``Dataset`` split
over clients by a spec), each giving what ``fedjax_sparse.run(..., data=...)`` takes. The partition
schemes themselves are the module ``partitions`` (``from fedjax_sparse.data.partitions import ...``).
"""
from fedjax_sparse.data.arrays import PartitionedData, from_arrays, load, load_npz, partition
from fedjax_sparse.data.datasets import DATASETS, Dataset, load_dataset
from fedjax_sparse.errors import DataError
from fedjax_sparse.data.federated import ClientData, FederatedData, build_federated_data
from fedjax_sparse.data.partitions import Partition, partition_dataset, partition_report

__all__ = ["DATASETS", "ClientData", "DataError", "Dataset", "FederatedData", "Partition", "PartitionedData",
           "build_federated_data", "from_arrays", "load", "load_dataset", "load_npz", "partition", "partition_dataset",
           "partition_report"]
