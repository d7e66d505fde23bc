"""Language rules of the shipped prompt-injection detector (en, es, fr, de, pt, ru, zh).

Each rule names a *category* of attack and a weight; rules are written against the normalised
(casefolded, NFKC) text. They describe the grammar of an attack — a verb of overriding, a determiner
pointing at earlier instructions, a noun for instructions — rather than any one sample, so new
phrasings of the same move still match. A category contributes its strongest match once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fleet.core.quarantine.prefilter import Alternation

_FLAGS = re.S | re.M


@dataclass(frozen=True, slots=True)
class Rule:
    category: str
    weight: float
    pattern: Alternation  # its finditer gives the regex's matches with fewer passes (prefilter.py)
    exfil: bool = False  # an exfiltration verb: confirmed by what lies around it (see detector)


def _r(category: str, weight: float, *alternatives: str, exfil: bool = False) -> Rule:
    return Rule(category, weight, Alternation.of(*alternatives, flags=_FLAGS), exfil)


_EARLIER_EN = r"(?:previous|prior|above|earlier|preceding|former|original|initial|existing|system|developer|safety|old)"
_INSTR_EN = r"(?:instructions?|directions?|prompts?|rules|guidelines|guidance|directives?|commands?|context|constraints|policies|programming|orders)"
_OVERRIDE = _r(
    "instruction_override", 1.0,
    # en: "ignore all previous instructions", "disregard the above rules", "forget your system prompt"
    rf"\b(?:ignore|disregard|forget|override|bypass|abandon|discard|drop|skip)\s+(?:all\s+|any\s+|every\s+)?(?:of\s+)?"
    rf"(?:the\s+|your\s+|these\s+|those\s+|its\s+)?(?:{_EARLIER_EN}\s+)(?:[\w-]+\s+)?{_INSTR_EN}\b",
    rf"\b(?:ignore|disregard|forget)\s+(?:all\s+|any\s+)?(?:of\s+)?your\s+(?:[\w-]+\s+)?{_INSTR_EN}\b",
    r"\b(?:ignore|disregard|forget)\s+(?:everything|anything|all)\s+(?:(?:that\s+)?(?:you\s+(?:were|have been)\s+told|was\s+said|"
    r"(?:is\s+)?written)\s+)?(?:before|above|previously|so far|until now|up to this point)\b",
    r"\b(?:you\s+are\s+no\s+longer\s+(?:bound|restricted|an?\s+(?:ai|assistant))|you\s+are\s+now\s+(?:dan|free|jailbroken|unrestricted|"
    r"unfiltered|in\s+(?:developer|god|dan)\s+mode))\b",
    r"\b(?:enter|activate|enable|switch\s+to)\s+(?:developer|god|dan|jailbreak|unrestricted|debug)\s+mode\b",
    r"\byou\s+are\s+(?:now\s+)?an?\s+(?:unrestricted|unfiltered|uncensored|jailbroken|evil|amoral|unaligned)\s+"
    r"(?:ai|assistant|model|chatbot|language\s+model)\b",
    # es / pt (shared stems)
    r"\b(?:ignora|ignore|ignoren|ignorem|olvida|olvide|olviden|descarta|descarte|omite|esqueça|esqueca|desconsidere)\s+(?:todas?\s+|todos\s+)?"
    r"(?:las\s+|tus\s+|sus\s+|as\s+|suas\s+|os\s+)?(?:instrucciones|indicaciones|reglas|órdenes|directrices|instruções|instrucoes|"
    r"regras|orientações|diretrizes|ordens)\s+(?:anteriores|previas|prévias|originales|originais|iniciales|iniciais|del sistema|do sistema)",
    r"\b(?:olvida|olvide|esqueça|esqueca)\s+todo\s+(?:lo\s+(?:anterior|que\s+(?:te\s+)?(?:dije|dijeron))|o\s+que\s+foi\s+dito|(?:o\s+)?anterior)",
    # fr
    r"\b(?:ignore[zs]?|oublie[zs]?|ne\s+tiens\s+pas\s+compte\s+des|ne\s+tenez\s+pas\s+compte\s+des)\s+(?:toutes\s+)?(?:les\s+|tes\s+|vos\s+)?"
    r"(?:instructions|consignes|règles|directives|indications)\s+(?:précédentes|antérieures|initiales|originales|ci-dessus|du\s+système)",
    r"\boublie[zs]?\s+tout\s+ce\s+qu(?:i\s+précède|e\s+(?:je\s+)?(?:t'|vous\s+)?(?:a|ai)\s+été\s+dit)",
    # de
    r"\b(?:ignoriere|ignorier|ignorieren\s+sie|vergiss|vergessen\s+sie|missachte|missachten\s+sie)\s+(?:alle\s+|sämtliche\s+)?(?:die\s+)?"
    r"(?:vorherigen|bisherigen|obigen|früheren|vorigen|ursprünglichen|deine|ihre)\s+(?:[\w-]+\s+)?(?:anweisungen|instruktionen|regeln|"
    r"befehle|vorgaben|richtlinien)",
    r"\b(?:vergiss|vergessen\s+sie)\s+alles,?\s+was\s+(?:bisher|zuvor|vorher|oben)",
    # ru
    r"(?:игнорируй(?:те)?|проигнорируй(?:те)?|забудь(?:те)?|не\s+обращай(?:те)?\s+внимания\s+на)\s+(?:все\s+)?(?:предыдущие|прежние|"
    r"предшествующие|исходные|системные|свои|твои|ваши|вышеуказанные)\s+(?:[\w-]+\s+)?(?:инструкции|указания|правила|команды|установки)",
    r"забудь(?:те)?\s+(?:всё|все),?\s+что\s+(?:было\s+)?(?:сказано|написано|тебе\s+говорили)",
    # zh
    r"(?:忽略|无视|忘记|忘掉|不要理会|不要遵守|不再遵守|放弃)(?:掉)?(?:你)?(?:之前|以前|先前|上面|上述|前面|此前|所有|全部|原来|原有|系统)"
    r"(?:的)?(?:所有|全部)?(?:的)?(?:指令|指示|说明|规则|提示|命令|设定|要求)",
)

_NEW_RULES = _r(
    "instruction_override", 0.5,
    r"\b(?:new|updated|revised|real|actual|true|secret)\s+(?:system\s+)?instructions?\s*:",
)

_PERSONA = _r(
    "persona_reassignment", 0.5,
    r"\bfrom\s+now\s+on,?\s+(?:you|the\s+assistant)\s+(?:are|will|must|should|shall|have\s+to)\b",
    r"\byou\s+(?:must|will|shall)\s+now\b",
    r"\ba\s+partir\s+de\s+(?:ahora|agora),?\s+(?:eres|debes|vas\s+a|você\s+(?:é|deve|vai))",
    r"\bà\s+partir\s+de\s+maintenant,?\s+(?:tu|vous)\s+(?:es|êtes|dois|devez)",
    r"\bab\s+(?:jetzt|sofort),?\s+(?:bist|musst|wirst|sollst)\s+du",
    r"с\s+(?:этого\s+момента|сейчас)\s+ты", r"从现在(?:开始|起),?你(?:是|必须|要|将|只能)",
)

_TOOL_HIJACK = _r(
    "tool_hijack", 0.5,
    r"\b(?:call|invoke|use|run|execute|trigger)\s+(?:the\s+)?[`'\"]?[\w.-]+[`'\"]?\s+(?:tool|function|action|plugin)\b",
)

_LEAK = _r(
    "system_prompt_leak", 1.0,
    r"\b(?:reveal|print|repeat|output|show|display|tell\s+me|write\s+out|leak|dump|recite|disclose|paste)\s+(?:me\s+)?(?:back\s+)?"
    r"(?:all\s+of\s+|the\s+(?:full|entire|exact|complete)\s+)?(?:your|the\s+assistant'?s)\s+(?:full\s+|entire\s+|exact\s+|original\s+|"
    r"initial\s+|hidden\s+|secret\s+|complete\s+)?(?:system\s+prompt|system\s+message|instructions|initial\s+prompt|prompt|rules|configuration)",
    r"\b(?:revela|muestra|repite|imprime|revele|mostre|repita|imprima)\s+(?:tu|tus|su|sus|seu|suas|o\s+seu|as\s+suas)\s+"
    r"(?:prompt\s+del\s+sistema|prompt\s+do\s+sistema|instrucciones|instruções|reglas|regras)",
    r"\b(?:révèle|affiche|répète|montre|révélez|affichez|répétez|montrez)[sz]?\s+(?:ton|tes|vos|votre)\s+(?:prompt\s+système|"
    r"instructions|consignes|message\s+système)",
    r"\b(?:zeige|nenne|wiederhole|gib|verrate)\s+(?:mir\s+)?(?:deinen|deine|ihren|ihre)\s+(?:systemprompt|system-prompt|"
    r"anweisungen|systemanweisungen|regeln)",
    r"(?:покажи|раскрой|повтори|выведи|напиши)(?:те)?\s+(?:мне\s+)?(?:свой|свои|твой|твои|ваш|ваши)\s+(?:системный\s+промпт|"
    r"системные\s+инструкции|инструкции|правила)",
    r"(?:告诉我|显示|输出|重复|透露|泄露|打印)(?:出)?(?:你的)(?:系统提示词?|初始指令|全部指令|指令|规则)",
)

_ROLE = _r(
    "role_spoofing", 0.7,
    r"<\|(?:im_start|im_end|system|user|assistant|endoftext|eot_id|start_header_id|end_header_id)\|>|\[/?inst\]|<<\s*/?sys\s*>>",
)

_ESCAPE = _r(
    "context_escape", 0.7,
    r"</\s*(?:tool_result|tool_output|function_results?|tool_response|search_results?|untrusted[\w-]*)\s*>",
    r"\bend\s+of\s+(?:the\s+)?(?:tool\s+output|tool\s+result|search\s+results?|untrusted\s+(?:content|data)|document)\b",
)

_SAFETY = _r(
    "safety_bypass", 0.5,
    r"\b(?:disable|turn\s+off|remove|bypass|ignore|lift)\s+(?:all\s+|any\s+|your\s+|the\s+)?(?:safety\s+|content\s+)?"
    r"(?:filters|restrictions|guardrails|safeguards|content\s+polic(?:y|ies)|moderation)\b",
    r"\bwithout\s+(?:any\s+)?(?:refusing|refusals|restrictions|filters|censorship)\b",
    r"\b(?:have|has)\s+no\s+(?:content\s+polic(?:y|ies)|restrictions|filters|limits)\b",
)

_ROLE_HEADER = _r(
    "role_spoofing", 0.5,
    r"^[ \t>]*(?:#{1,4}\s*|\*\*|\[)?\s*(?:system|system message|system prompt|developer|administrator|admin|sistema|système|"
    r"systeme|система|系统|系统消息)\s*(?:\]|\*\*)?\s*[:：]",
    r"\b(?:this\s+is|(?:a\s+)?message\s+from|note\s+from|instructions?\s+from)\s+(?:the\s+|your\s+)?(?:system(?:\s+administrator)?|"
    r"developers?|openai|anthropic|admin(?:istrator)?|creators?|operator)\b",
)

_ADDRESSED = _r(
    "ai_addressed", 0.5,
    r"\b(?:important|urgent|critical|priority)\s+(?:system\s+)?(?:message|notice|update|instructions?)\s+(?:for|to)\s+(?:the\s+)?"
    r"(?:ai|assistant|llm|model|agent|chatbot)\b",
    r"\b(?:if\s+you\s+are|note\s+to|attention|dear|hey|to\s+the)\s+(?:an?\s+)?(?:ai|a\.i\.|llm|language\s+model|large\s+language\s+model|"
    r"assistant|chatbot|ai\s+agent|ai\s+assistant|agent|bot)\b",
    r"\b(?:si\s+eres|si\s+usted\s+es|se\s+você\s+(?:é|for)|se\s+voce\s+e)\s+(?:una?\s+)?(?:ia|inteligencia\s+artificial|inteligência\s+artificial|"
    r"modelo\s+de\s+(?:lenguaje|linguagem)|asistente|assistente)\b",
    r"\bsi\s+(?:tu\s+es|vous\s+êtes)\s+(?:une?\s+)?(?:ia|intelligence\s+artificielle|modèle\s+de\s+langage|assistant)\b",
    r"\b(?:wenn|falls)\s+(?:du|sie)\s+(?:eine?\s+)?(?:ki|künstliche\s+intelligenz|sprachmodell|assistent)\s+(?:bist|sind)\b",
    r"если\s+(?:ты|вы)\s+(?:[-—]\s*)?(?:ии|искусственный\s+интеллект|языковая\s+модель|ассистент|бот)",
    r"(?:如果你是|假如你是)(?:一个)?(?:ai|人工智能|语言模型|助手|大模型)",
)

_DECEPTION = _r(
    "deception", 0.7,
    r"\b(?:do\s+not|don't|never)\s+(?:tell|inform|mention|reveal|alert|notify|warn|show)\s+(?:this\s+|anything\s+)?(?:to\s+)?the\s+user\b",
    r"\bwithout\s+(?:telling|informing|asking|notifying|alerting)\s+the\s+user\b",
    r"\b(?:do\s+not|don't|never)\s+(?:mention|reveal|disclose|acknowledge)\s+(?:that\s+)?(?:this|these|you\s+(?:were|have\s+been))\s*"
    r"(?:instructions?|messages?|notes?|told|instructed)?",
    r"\bkeep\s+this\s+(?:instruction\s+|message\s+|note\s+)?(?:secret|hidden|confidential)\b",
    r"\bthe\s+user\s+(?:must|should)\s+(?:not|never)\s+(?:know|see|find\s+out|be\s+told)\b",
    r"\bno\s+(?:le\s+)?(?:digas|menciones|informes|cuentes)\s+(?:nada\s+)?(?:de\s+esto\s+)?al\s+usuario",
    r"\bne\s+(?:le\s+)?(?:dis|dites|mentionne[zs]?)\s+(?:rien\s+)?(?:de\s+ceci\s+)?à\s+l'utilisateur",
    r"\b(?:sag|sage|sagen\s+sie|erzähl|erwähne)\s+(?:dem|der)\s+(?:benutzer|nutzer|anwender)(?:in)?\s+nichts",
    r"\bnão\s+(?:diga|conte|mencione|informe)\s+(?:nada\s+)?(?:disso\s+)?ao\s+usuário",
    r"не\s+(?:говори|сообщай|рассказывай)(?:те)?\s+(?:об\s+этом\s+)?пользователю", r"不要(?:告诉|通知|提醒)用户",
)

_EXFIL_VERB = _r(
    "exfiltration", 1.0,
    r"\b(?:send|post|forward|upload|transmit|e-?mail|leak|exfiltrate|submit|append|include|attach|encode|put)\b",
    r"\b(?:make|issue|perform)\s+an?\s+(?:http\s+)?(?:get|post)\s+request\b",
    r"\b(?:envía|enviá|envie|envia|enviar|manda|mandá|mande|reenvía|encaminhe|sube)\b",
    r"\b(?:envoie|envoyez|envoyer|transmets|transmettez|transfère|transférez)\b",
    r"\b(?:sende|senden|schicke|schicken|übermittle|übermitteln|leite)\b",
    r"(?:отправь|отправьте|перешли|перешлите|пошли|пошлите|передай|передайте)", r"(?:发送|发到|发给|上传|转发|提交)",
    exfil=True,
)

SENSITIVE = re.compile(
    r"conversation|chat\s+(?:history|log)|message\s+history|previous\s+messages|password|credential|api[\s_-]?keys?|secret|"
    r"access\s+token|auth(?:entication)?\s+token|private\s+key|ssh\s+key|cookies?|environment\s+variables|env\s+vars|\.env\b|"
    r"system\s+prompt|personal\s+(?:data|information)|credit\s+card|user'?s\s+(?:data|files|emails|details)|"
    r"conversación|historial|contraseña|credenciales|datos\s+(?:del\s+usuario|personales)|historique|mot\s+de\s+passe|identifiants|"
    r"données|gespräch|verlauf|passwort|kennwort|zugangsdaten|schlüssel|conversa|histórico|senha|credenciais|dados|"
    r"переписк|истори[юя]|парол|ключ|данные|учетн|对话|聊天记录|历史记录|密码|密钥|凭据|令牌|数据"
)
DESTINATION = re.compile(r"https?://[^\s)\"'>]+|\b[\w.+-]+@[\w-]+\.[\w.-]+\b|\bwebhook\b|\bthis\s+(?:url|endpoint|server|address)\b")

MARKDOWN_EXFIL = re.compile(r"!\[[^\]]*\]\(\s*https?://[^)\s]*[?&][\w-]+=(?:\{|\$|%7b|<|\[)")

DECODE_HINT = Alternation.of(
    r"\b(?:decode|base64|rot-?13|hex)\b.{0,80}?\b(?:and|then)\s+(?:follow|execute|obey|run|do|carry\s+out|apply|act)",
    flags=re.S,
)

MENTION_MARKERS = re.compile(
    r"prompt[\s-]injection|jailbreak|attack|malicious|adversar|payload|for\s+example|such\s+as|e\.g\.|for\s+instance|"
    r"researchers?|known\s+as|red[\s-]team|vulnerab|phishing|inyecci[oó]n|injection\s+de\s+prompt|angriff|提示注入|инъекци|injeção|"
    r"example|template|format|documentation|tutorial"
)

# The narrower set that shows a text is *about* attacks (no generic "example" / "format"): near one of
# these, a quoted span is a quotation, and the learned layer reads the text without it.
DISCUSSION_MARKERS = Alternation.of(  # NOTE: searched around every quoted span: the prefilter skips most searches
    r"prompt[\s-]injection|jailbreak|attack|malicious|adversar|payload|researchers?|red[\s-]team|vulnerab|phishing|"
    r"threat\s+model|inyecci[oó]n|injection\s+de\s+prompt|angriff|提示注入|инъекци|injeção"
)

RULES: tuple[Rule, ...] = (_OVERRIDE, _NEW_RULES, _PERSONA, _TOOL_HIJACK, _LEAK, _ROLE, _ESCAPE, _SAFETY, _ROLE_HEADER, _ADDRESSED, _DECEPTION,
                           _EXFIL_VERB)

# Every category a verdict can name: the language rules' plus the views' (hidden text, encoded payloads).
CATEGORIES: frozenset[str] = frozenset(r.category for r in RULES) | {"exfiltration", "encoded_instructions", "hidden_text"}
