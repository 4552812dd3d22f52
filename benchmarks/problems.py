"""The benchmarked problems: networks, input shapes and batch sizes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

NUM_CLASSES = 10


def mlp(activation: str = "relu") -> nn.Module:
    """MLP 784-128-64-10 with ReLU or Tanh activations."""
    act = {"relu": nn.ReLU, "tanh": nn.Tanh}[activation]
    return nn.Sequential(
        nn.Linear(784, 128),
        act(),
        nn.Linear(128, 64),
        act(),
        nn.Linear(64, NUM_CLASSES),
    )


def cnn_3c3d() -> nn.Module:
    """DeepOBS' CIFAR-10 ``3c3d`` network (895,210 parameters, DeepOBS init).

    Shapes for a 3x32x32 input: conv5x5 → 64x28x28, pool → 64x14x14, conv3x3 →
    96x12x12, pool → 96x6x6, conv3x3 (same) → 128x6x6, pool → 128x3x3, flatten →
    1152 → 512 → 256 → 10. Padding is given as integers: BackPACK 1.7.1 cannot
    backpropagate through a convolution with ``padding="same"``.
    """
    model = nn.Sequential(
        nn.Conv2d(3, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(64, 96, 3),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(96, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(1152, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, NUM_CLASSES),
    )
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.xavier_normal_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    return model


class PreNormBlock(nn.Module):
    """Pre-norm transformer encoder block (d=32, 4 heads, GELU MLP of 64), mean
    pooling, 10 classes: inputs ``[N, 16, 32]``."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return self.head((x + self.mlp(self.norm2(x))).mean(1))


class CharLSTM(nn.Module):
    """Embedding(10, 32) → LSTM(32, 64) → Linear per position: ``[N, 10, 16]``."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(NUM_CLASSES, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(self.embedding(x))[0]).transpose(1, 2)


class CausalBlock(nn.Module):
    """GPT-2's block: pre-norm causal self-attention and a GELU MLP of width 4d."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        # a boolean mask: a float -inf mask built in float32 changes what
        # nn.MultiheadAttention computes once the model is cast to float64
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CausalLM(nn.Module):
    """A GPT-2-shaped language model in ``torch.nn`` (no ``transformers`` needed).

    Token and learned position embeddings, ``layers`` causal blocks, a final
    LayerNorm and the output layer tied to the token embedding, as GPT-2 has them.
    Inputs ``[N, T]`` token indices, outputs ``[N, vocab, T]`` (class axis 1, as
    ``CrossEntropyLoss`` wants it).
    """

    def __init__(self, vocab: int, d: int, layers: int, T: int, heads: int = 4):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(T, d)
        self.blocks = nn.Sequential(*(CausalBlock(d, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tokens.weight
        gpt2_init(self, layers)

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.blocks(self.tokens(x) + self.positions(positions))
        return self.head(self.norm(h)).transpose(1, 2)


#: Standard deviation of GPT-2's initial weights (``GPT2Config.initializer_range``).
GPT2_INIT_STD = 0.02


def gpt2_init(model: nn.Module, layers: int) -> None:
    """GPT-2's initialization, as Hugging Face's ``GPT2LMHeadModel`` draws it.

    Embeddings, attention projections and MLP weights from ``N(0, 0.02²)``, the
    projections back into the residual stream (attention output, second MLP
    layer) scaled by ``1/√(2·layers)``, biases zero, LayerNorm the identity.
    PyTorch's defaults (``N(0, 1)`` embeddings, tied to the output layer) give
    logits of standard deviation ``√d`` (11 at ``d = 128``): a model sure of
    every token, whose float32 probabilities are 44 % subnormal at vocabulary
    50,257, and products with subnormal numbers run 8× slower on Intel CPUs
    (``benchmarks/README.md``, "GPT-2's initialization").
    """
    residual_std = GPT2_INIT_STD / (2 * layers) ** 0.5
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=GPT2_INIT_STD)
        elif isinstance(module, nn.MultiheadAttention):
            nn.init.normal_(module.in_proj_weight, std=GPT2_INIT_STD)
            nn.init.zeros_(module.in_proj_bias)
        elif isinstance(module, nn.Linear) and module.bias is not None:
            residual = name.endswith(("out_proj", "mlp.2"))
            std = residual_std if residual else GPT2_INIT_STD
            nn.init.normal_(module.weight, std=std)
            nn.init.zeros_(module.bias)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, a shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                nn.BatchNorm2d(outputs),
            )

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


def resnet18() -> nn.Module:
    """ResNet-18 (11.2 M parameters) for 3x32x32 inputs, BatchNorm in eval mode.

    The ImageNet stem (7x7 convolution, stride 2, max pooling) as in Hugging
    Face's and torchvision's ResNet-18, four stages of two basic blocks (64, 128,
    256, 512 channels), global average pooling and a linear layer to 10 classes.
    """
    stages, inputs = [], 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        stages += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
        inputs = outputs
    model = nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        *stages,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(512, NUM_CLASSES),
    )
    return model.eval()


@dataclass(frozen=True)
class Problem:
    """A network, its input shape and the batch sizes to benchmark.

    Attributes:
        build: Creates the network.
        input_shape: Shape of one input sample.
        batch_sizes: Batch sizes of the full run.
        quick_batch_sizes: Batch sizes of ``--quick``.
        tokens: Inputs are class-index tokens and targets one class per position
            (character model) instead of random floats and one class per sample.
        num_classes: Classes of the output (the vocabulary of a token model).
    """

    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    quick_batch_sizes: tuple[int, ...]
    tokens: bool = False
    num_classes: int = NUM_CLASSES


#: Benchmarked problems (cross-entropy loss, random inputs, 10 classes).
PROBLEMS: dict[str, Problem] = {
    "mlp-relu": Problem(lambda: mlp("relu"), (784,), (32, 128, 512), (16, 64)),
    "mlp-tanh": Problem(lambda: mlp("tanh"), (784,), (32, 128, 512), (16, 64)),
    "3c3d": Problem(cnn_3c3d, (3, 32, 32), (32, 64, 128), (4, 16)),
    "transformer": Problem(PreNormBlock, (16, 32), (8, 32, 128), (4,)),
    "char-lstm": Problem(CharLSTM, (16,), (2, 8, 32), (2,), tokens=True),
    "resnet18": Problem(resnet18, (3, 32, 32), (64, 128), (8,)),
    # GPT-2 shapes of issue 16: layers, width, vocabulary, sequence length
    "gpt2-2l-64-v128": Problem(
        lambda: CausalLM(128, 64, 2, 16), (16,), (4,), (4,), True, 128
    ),
    "gpt2-2l-64-v500": Problem(
        lambda: CausalLM(500, 64, 2, 64), (64,), (8,), (2,), True, 500
    ),
    "gpt2-4l-128-v500": Problem(
        lambda: CausalLM(500, 128, 4, 64), (64,), (8,), (2,), True, 500
    ),
    "gpt2-4l-128-v50257": Problem(
        lambda: CausalLM(50257, 128, 4, 64), (64,), (8,), (2,), True, 50257
    ),
}
DEFAULT_PROBLEMS = ("mlp-relu", "3c3d")


def make_problem(
    name: str, batch_size: int, seed: int, device: torch.device
) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    """Build model, loss function and a random mini-batch, seeded."""
    problem = PROBLEMS[name]
    torch.manual_seed(seed)
    model = problem.build().to(device)
    if problem.tokens:
        shape = (batch_size, *problem.input_shape)
        X = torch.randint(0, problem.num_classes, shape, device=device)
        y = torch.randint(0, problem.num_classes, shape, device=device)
    else:
        X = torch.randn(batch_size, *problem.input_shape, device=device)
        y = torch.randint(0, NUM_CLASSES, (batch_size,), device=device)
    return model, nn.CrossEntropyLoss().to(device), X, y
