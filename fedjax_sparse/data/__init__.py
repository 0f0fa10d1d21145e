"""Datasets (original file formats), partitions and stacked client data."""
from fedjax_sparse.data.datasets import DATASETS, DataError, Dataset, load_dataset
from fedjax_sparse.data.federated import ClientData, FederatedData, build_federated_data
from fedjax_sparse.data.partition import Partition, partition_dataset, partition_report

__all__ = ["DATASETS", "ClientData", "DataError", "Dataset", "FederatedData", "Partition",
           "build_federated_data", "load_dataset", "partition_dataset", "partition_report"]
