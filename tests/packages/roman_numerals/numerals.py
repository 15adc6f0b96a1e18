import numpy as np
import roman

from switchyard_client.model import Partial


class Numerals:
    def predict(self, batch):
        numerals, errors = [], {}
        for row, number in enumerate(batch["number"]):
            try:
                numerals.append(roman.toRoman(int(number)))
            except roman.RomanError as exc:  # out of range: this row fails, the others answer
                numerals.append("")
                errors[row] = str(exc)
        return Partial({"numeral": np.array(numerals, dtype=object)}, errors)
