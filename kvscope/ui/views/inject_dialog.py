"""Inject request(s): prompt text, chat or token ids, max tokens, n, beam width, temperature, seed, presets.

A preset fills the prompt box; editing the text afterwards turns it into a custom prompt (the
edited text is what is injected). ``has_tokenizer=False`` (a model without a tokenizer) starts in
the token-ids mode and says so; token ids are integers separated by commas or spaces.
"""

from __future__ import annotations

import re

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine import SamplingParams
from kvscope.presets import PRESETS
from kvscope.sources.base import InjectSpec


def parse_token_ids(text: str, vocab_size: int | None = None) -> list[int]:
    """``"1, 5 9"`` -> [1, 5, 9]; raises ValueError with the offending piece."""
    pieces = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not pieces:
        raise ValueError("no token ids: type integers separated by commas or spaces, e.g. 1, 5, 9")
    ids = []
    for p in pieces:
        if not re.fullmatch(r"\d+", p):
            raise ValueError(f"{p!r} is not a token id: type integers separated by commas or spaces, e.g. 1, 5, 9")
        ids.append(int(p))
    if vocab_size is not None:
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return ids


class InjectDialog(QDialog):
    def __init__(
        self, parent: QWidget | None = None, settings=None, has_tokenizer: bool = True, vocab_size: int | None = None
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Inject request")
        self.settings = settings
        self.has_tokenizer = has_tokenizer
        self.vocab_size = vocab_size
        self.preset = QComboBox()
        self.preset.addItems(["(custom)"] + list(PRESETS))
        self.preset.currentTextChanged.connect(self._on_preset)
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("prompt text (or a user message when 'as chat' is on)")
        self.prompt.textChanged.connect(self._on_edit)
        self.as_chat = QCheckBox("as chat (apply the chat template)")
        self.as_chat.setChecked(True)
        self.as_ids = QCheckBox("token ids (integers separated by commas or spaces)")
        self.as_ids.toggled.connect(self._on_ids_mode)
        self.no_tokenizer = QLabel("This model has no tokenizer: type token ids, e.g. 1, 5, 9.")
        self.no_tokenizer.setStyleSheet("color: #fbc02d")
        self.no_tokenizer.setVisible(not has_tokenizer)
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
        form.addRow("", self.no_tokenizer)
        form.addRow("prompt", self.prompt)
        form.addRow("", self.as_chat)
        form.addRow("", self.as_ids)
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
        self._preset_text: str | None = None  # the text the preset put in the box
        self._restore()
        if not has_tokenizer:  # text and chat need a tokenizer: token ids are the only way in
            self.as_chat.setChecked(False)
            self.as_ids.setChecked(True)
            self.as_ids.setEnabled(False)
            self.preset.setEnabled(False)
            self.preset.setToolTip("presets are text: this model has no tokenizer")

    def _on_preset(self, name: str) -> None:
        value = PRESETS.get(name)
        if value is None:
            self._preset_prompts = self._preset_text = None
            return
        prompts = value if isinstance(value, list) else [value]
        first = prompts[0]
        text = first if isinstance(first, str) else first[-1]["content"]
        self._preset_prompts, self._preset_text = None, None
        self.as_ids.setChecked(False)
        self.prompt.setPlainText(text)
        self.as_chat.setChecked(not isinstance(first, str))
        self._preset_prompts, self._preset_text = prompts, text

    def _on_edit(self) -> None:
        """An edit of a preset's text makes it a custom prompt: the edited text is what is injected."""
        if self._preset_text is not None and self.prompt.toPlainText() != self._preset_text:
            self._preset_prompts = self._preset_text = None
            self.preset.blockSignals(True)
            self.preset.setCurrentIndex(0)
            self.preset.blockSignals(False)

    def _on_ids_mode(self, on: bool) -> None:
        self.as_chat.setEnabled(not on and self.has_tokenizer)
        self.prompt.setPlaceholderText(
            "token ids, e.g. 1, 5, 9" if on else "prompt text (or a user message when 'as chat' is on)"
        )
        if on and self._preset_prompts is not None:
            self._preset_prompts = self._preset_text = None
            self.preset.blockSignals(True)
            self.preset.setCurrentIndex(0)
            self.preset.blockSignals(False)

    def params(self) -> SamplingParams:
        seed = self.seed.value()
        beam = self.beam_width.value()
        return SamplingParams(
            max_tokens=self.max_tokens.value(),
            temperature=self.temperature.value(),
            n=self.n.value(),
            seed=None if seed < 0 else seed,
            use_beam_search=beam > 0,
            beam_width=max(beam, 1),
        )

    def specs(self) -> list[InjectSpec]:
        """The requests to inject (raises ValueError on bad settings)."""
        params = self.params()
        if self._preset_prompts is not None:
            prompts = self._preset_prompts
        elif self.as_ids.isChecked():
            prompts = [parse_token_ids(self.prompt.toPlainText(), self.vocab_size)]
        else:
            text = self.prompt.toPlainText()
            if not self.has_tokenizer:
                raise ValueError("this model has no tokenizer: type token ids, e.g. 1, 5, 9")
            prompts = [[{"role": "user", "content": text}] if self.as_chat.isChecked() and text.strip() else text]
        return [InjectSpec(p, params) for p in prompts for _ in range(self.copies.value())]

    def accept(self) -> None:
        self._save()
        super().accept()

    def _save(self) -> None:
        if self.settings is None:
            return
        for key, w in (
            ("max_tokens", self.max_tokens),
            ("n", self.n),
            ("seed", self.seed),
            ("beam_width", self.beam_width),
        ):
            self.settings.setValue(f"inject/{key}", w.value())
        self.settings.setValue("inject/temperature", self.temperature.value())
        self.settings.setValue("inject/as_chat", self.as_chat.isChecked())
        if self.has_tokenizer:
            self.settings.setValue("inject/as_ids", self.as_ids.isChecked())

    def _restore(self) -> None:
        if self.settings is None:
            return
        for key, w in (
            ("max_tokens", self.max_tokens),
            ("n", self.n),
            ("seed", self.seed),
            ("beam_width", self.beam_width),
        ):
            v = self.settings.value(f"inject/{key}")
            if v is not None:
                w.setValue(int(v))
        v = self.settings.value("inject/temperature")
        if v is not None:
            self.temperature.setValue(float(v))
        v = self.settings.value("inject/as_chat")
        if v is not None:
            self.as_chat.setChecked(str(v).lower() in ("true", "1"))
        v = self.settings.value("inject/as_ids")
        if v is not None and self.has_tokenizer:
            self.as_ids.setChecked(str(v).lower() in ("true", "1"))
