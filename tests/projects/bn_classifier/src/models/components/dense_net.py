"""The templates' dense network: Linear -> BatchNorm1d -> ReLU, three times, then a Linear head."""

from torch import nn


class SimpleDenseNet(nn.Module):
    def __init__(
        self,
        input_size: int = 16,
        lin1_size: int = 32,
        lin2_size: int = 32,
        lin3_size: int = 32,
        output_size: int = 4,
    ) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size),
            nn.BatchNorm1d(lin1_size),
            nn.ReLU(),
            nn.Linear(lin1_size, lin2_size),
            nn.BatchNorm1d(lin2_size),
            nn.ReLU(),
            nn.Linear(lin2_size, lin3_size),
            nn.BatchNorm1d(lin3_size),
            nn.ReLU(),
            nn.Linear(lin3_size, output_size),
        )

    def forward(self, x):
        return self.model(x.view(x.size(0), -1))
