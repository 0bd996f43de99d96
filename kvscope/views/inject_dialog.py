"""Inject request(s): prompt text or chat, max tokens, n, beam width, temperature, seed, presets."""
from __future__ import annotations

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine import SamplingParams

from ..presets import PRESETS
from ..sources.base import InjectSpec


class InjectDialog(QDialog):
    def __init__(self, parent: QWidget | None = None, settings=None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Inject request")
        self.settings = settings
        self.preset = QComboBox()
        self.preset.addItems(["(custom)"] + list(PRESETS))
        self.preset.currentTextChanged.connect(self._on_preset)
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("prompt text (or a user message when 'as chat' is on)")
        self.as_chat = QCheckBox("as chat (apply the chat template)")
        self.as_chat.setChecked(True)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 100_000)
        self.max_tokens.setValue(64)
        self.n = QSpinBox()
        self.n.setRange(1, 64)
        self.beam_width = QSpinBox()
        self.beam_width.setRange(0, 16)
        self.beam_width.setSpecialValueText("off")
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 5.0)
        self.temperature.setSingleStep(0.1)
        self.seed = QSpinBox()
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setValue(-1)
        self.seed.setSpecialValueText("none")
        self.copies = QSpinBox()
        self.copies.setRange(1, 256)
        form = QFormLayout()
        form.addRow("preset", self.preset)
        form.addRow("prompt", self.prompt)
        form.addRow("", self.as_chat)
        form.addRow("max tokens", self.max_tokens)
        form.addRow("n (parallel samples)", self.n)
        form.addRow("beam width (n = beams returned)", self.beam_width)
        form.addRow("temperature (0 = greedy)", self.temperature)
        form.addRow("seed", self.seed)
        form.addRow("copies", self.copies)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(buttons)
        self._preset_prompts: list | None = None
        self._restore()

    def _on_preset(self, name: str) -> None:
        value = PRESETS.get(name)
        if value is None:
            self._preset_prompts = None
            return
        self._preset_prompts = value if isinstance(value, list) else [value]
        first = self._preset_prompts[0]
        self.prompt.setPlainText(first if isinstance(first, str) else first[-1]["content"])
        self.as_chat.setChecked(not isinstance(first, str))

    def params(self) -> SamplingParams:
        seed = self.seed.value()
        beam = self.beam_width.value()
        return SamplingParams(max_tokens=self.max_tokens.value(), temperature=self.temperature.value(),
                              n=self.n.value(), seed=None if seed < 0 else seed,
                              use_beam_search=beam > 0, beam_width=max(beam, 1))

    def specs(self) -> list[InjectSpec]:
        """The requests to inject (raises ValueError on bad settings)."""
        params = self.params()
        if self._preset_prompts is not None:
            prompts = self._preset_prompts
        else:
            text = self.prompt.toPlainText()
            prompts = [[{"role": "user", "content": text}] if self.as_chat.isChecked() and text.strip() else text]
        return [InjectSpec(p, params) for p in prompts for _ in range(self.copies.value())]

    def accept(self) -> None:
        self._save()
        super().accept()

    def _save(self) -> None:
        if self.settings is None:
            return
        for key, w in (("max_tokens", self.max_tokens), ("n", self.n), ("seed", self.seed),
                       ("beam_width", self.beam_width)):
            self.settings.setValue(f"inject/{key}", w.value())
        self.settings.setValue("inject/temperature", self.temperature.value())
        self.settings.setValue("inject/as_chat", self.as_chat.isChecked())

    def _restore(self) -> None:
        if self.settings is None:
            return
        for key, w in (("max_tokens", self.max_tokens), ("n", self.n), ("seed", self.seed),
                       ("beam_width", self.beam_width)):
            v = self.settings.value(f"inject/{key}")
            if v is not None:
                w.setValue(int(v))
        v = self.settings.value("inject/temperature")
        if v is not None:
            self.temperature.setValue(float(v))
        v = self.settings.value("inject/as_chat")
        if v is not None:
            self.as_chat.setChecked(str(v).lower() in ("true", "1"))
