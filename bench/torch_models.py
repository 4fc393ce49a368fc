"""dp's three models as PyTorch modules, defined once for every Python script in the repository.

The same layers as models/model.cpp, with dp's parameter names, so a module's state_dict has exactly
the names and layouts of a dp checkpoint (conv1.weight [out, in, kh, kw], fc1.weight [out, in]).
Used by bench/make_golden.py (the golden files' reference), bench/torch_compare.py (PyTorch's side
of the speed comparison) and docs/load_into_pytorch.py (a checkpoint loaded into PyTorch), with
the safetensors dtype table that the two safetensors readers share.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# The safetensors dtypes that dp and the golden files write: name -> (numpy dtype, torch dtype).
SAFETENSORS_DTYPES = {
    "F32": (np.dtype("<f4"), torch.float32),
    "I64": (np.dtype("<i8"), torch.int64),  # BatchNorm's num_batches_tracked
}


class LeNet(nn.Module):
    """dp's lenet: conv 3x3, relu, avgpool 2, conv 5x5, relu, avgpool 2, fc 800-128, relu, fc 128-10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 3)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(800, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):  # (N, 1, 28, 28)
        x = F.avg_pool2d(F.relu(self.conv1(x)), 2)  # (N, 20, 26, 26) -> (N, 20, 13, 13)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)  # (N, 50, 9, 9) -> (N, 50, 4, 4)
        x = F.relu(self.fc1(torch.flatten(x, 1)))  # (N, 800) -> (N, 128)
        return self.fc2(x)  # (N, 10)


class LeNet5(nn.Module):
    """dp's lenet5, the classic LeNet-5: sigmoids, average pooling, conv1 padded to keep 28x28."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(400, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):  # (N, 1, 28, 28)
        x = F.avg_pool2d(torch.sigmoid(self.conv1(x)), 2)  # (N, 6, 28, 28) -> (N, 6, 14, 14)
        x = F.avg_pool2d(torch.sigmoid(self.conv2(x)), 2)  # (N, 16, 10, 10) -> (N, 16, 5, 5)
        x = torch.sigmoid(self.fc1(torch.flatten(x, 1)))  # (N, 400) -> (N, 120)
        x = torch.sigmoid(self.fc2(x))  # (N, 84)
        return self.fc3(x)  # (N, 10)


class LeNetBN(nn.Module):
    """dp's lenet-bn: lenet with BatchNorm after conv1, conv2 (2d) and fc1 (1d), each before its ReLU.

    Its parameters, in module order: conv1.*, bn1.*, conv2.*, bn2.*, fc1.*, bn3.*, fc2.* (bn*.weight
    is gamma, initialised to 1, bn*.bias beta, to 0). Its running statistics (bn*.running_mean,
    bn*.running_var, bn*.num_batches_tracked, starting at PyTorch's 0, 1 and 0) are in dp's
    checkpoint too, as PyTorch's state_dict holds them; model.eval() normalises with them, as dp
    evaluates."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 3)
        self.bn1 = nn.BatchNorm2d(20)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.bn2 = nn.BatchNorm2d(50)
        self.fc1 = nn.Linear(800, 128)
        self.bn3 = nn.BatchNorm1d(128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):  # (N, 1, 28, 28)
        x = F.avg_pool2d(F.relu(self.bn1(self.conv1(x))), 2)  # (N, 20, 26, 26) -> (N, 20, 13, 13)
        x = F.avg_pool2d(F.relu(self.bn2(self.conv2(x))), 2)  # (N, 50, 9, 9) -> (N, 50, 4, 4)
        x = F.relu(self.bn3(self.fc1(torch.flatten(x, 1))))  # (N, 800) -> (N, 128)
        return self.fc2(x)  # (N, 10)


# dp's model names (dp_train --model) in dp's order.
MODELS = {"lenet": LeNet, "lenet5": LeNet5, "lenet-bn": LeNetBN}
