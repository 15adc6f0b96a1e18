"""Template filters of the audit log."""

from __future__ import annotations

from django import template
from django.utils.html import format_html_join
from django.utils.safestring import SafeString, mark_safe

register = template.Library()


@register.filter
def action_breaks(action: str) -> SafeString:
    """``plan.arm_drop`` with a line-break opportunity after each dot: a narrow column wraps
    an action between its words, never in the middle of one."""
    return format_html_join(mark_safe(".<wbr>"), "{}", ((part,) for part in action.split(".")))
