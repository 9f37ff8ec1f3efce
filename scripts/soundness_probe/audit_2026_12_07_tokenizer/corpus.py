"""Hand-built corpus (several hundred strings) + seeded random fuzz strings for the tokenizer audit."""
import random


def _cases():
    C = []  # (category, text)
    add = lambda cat, xs: C.extend((cat, x) for x in xs)
    add("basic", ["", " ", "  ", "a", "A", "Hello", "Hello world", " Hello world", "Hello world ", "hello, world!",
                  "The quick brown fox jumps over the lazy dog.", "THE QUICK BROWN FOX", "CamelCaseWordsHere",
                  "snake_case_words_here", "kebab-case-words", "e.g. i.e. etc. Mr. Dr. U.S.A.",
                  "It was the best of times, it was the worst of times; it was the age of wisdom...",
                  "Question? Answer! Exclamation!! Interrobang?!", "a\tb", "x", "Ġ", "Ċ", "ĠĠ", "âĢĻ"])
    add("prose", [
        "In 1492, Columbus sailed the ocean blue.",
        "Once upon a time, there lived a king who had three daughters. The youngest was the fairest of all.",
        "Machine learning is a field of study in artificial intelligence concerned with the development of statistical algorithms.",
        "She said, \"I don't know what you're talking about.\" He replied: 'Neither do I.'",
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua.",
        "Name three primary colors.", "What's the capital of France?", "Summarize the following text in one sentence:",
        "Dear Sir/Madam,\n\nI am writing to inquire about...\n\nSincerely,\nJohn", "TL;DR: it works (mostly).",
        "The price is $19.99 (USD) — or €17,50 in Europe.", "Email me at john.doe@example.com or visit https://example.com/path?q=1&r=2#frag",
        "#hashtag @mention $TICKER %percent ^caret &amp *star", "C:\\Users\\name\\Documents\\file.txt", "/usr/local/bin/python3 -m pip install -U pip",
    ])
    add("code", [
        "def f(x):\n\tif x > 1:\n        return [i * 2 for i in range(x)]\n\treturn None\n",
        "def add(a, b):\n    return a + b\n",
        "class Foo:\n    def __init__(self):\n        self.x = 1\n\n    def bar(self) -> int:\n        return self.x\n",
        "\tindented with tab\n\t\tdouble tab\n\t\t\ttriple tab",
        "if (x == 1) {\n  y = 2;\n} else {\n  y = 3;\n}",
        "for i in range(10):\n\tprint(i)\n", "    four spaces\n        eight spaces\n            twelve", "x = [1,2,3]\ny = {'a': 1, \"b\": 2}",
        "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
        "SELECT * FROM users WHERE id = 1 AND name LIKE '%smith%';", "<div class=\"a\"><span>text</span></div>",
        "```python\nprint('hi')\n```", "$ echo $HOME && ls -la | grep '^d'", "lambda x: x**2 if x>=0 else -x//3",
        "a != b <= c >= d == e => f -> g :: h ... i", "fn main() { let v: Vec<u8> = vec![0xFF, 0x00]; }",
        "\t\t\t", "\t \t \t", " \t", "\t ", "def f():\n\tpass\n\n\n\ndef g():\n    pass",
    ])
    add("json", [
        '{"key": "value", "n": 12, "arr": [1, 2.5, -3e10, true, null]}',
        '{\n  "a": {\n    "b": [\n      1,\n      2\n    ]\n  }\n}', '[]', '{}', '{"":""}', '{"emoji": "\\ud83d\\ude00", "nl": "a\\nb"}',
        '{"text": "<|im_end|>"}', '[{"role": "user", "content": "hi"}]',
    ])
    add("whitespace", [
        "\n", "\n\n", "\n\n\n", "\n\n\n\n\n\n\n\n", "\r\n", "\r\n\r\n", "\r", "\r\r\n\n", "a\r\nb", "a\rb", "a\n\nb", "a\n\n\nb",
        "a \nb", "a  \n  b", "trailing space ", "trailing spaces   ", "   leading spaces", "a  b", "a   b", "a    b", "a" + " " * 17 + "b",
        " " * 2, " " * 3, " " * 16, " " * 64, "\t" * 8, "\n" * 33, " \n \n ", "\u00a0", "a\u00a0b", "a\u2003b", "a\u3000b", "a\u2028b",
        "a\u2029b", "a\u0085b", "\x0b", "\x0c", "a\x0bb\x0cc", "\n ", " \n", "end.\n", "end. \n", "x\n\ty", "x\n \ty", "x \n\ty",
        "\u200b", "a\u200bb", "\ufeffBOM", "a\u202fb", "a\u205fb",
    ])
    add("numbers", [
        "0", "1", "12", "123", "1234", "12345", "123456789012345678901234567890", "3.14159", "3.14159265358979323846",
        "1,000,000", "1.000.000,00", "-42", "+7", "1e10", "6.022e23", "0x1F", "0b1010", "007", "2024-12-07", "12:34:56",
        "v1.2.3", "$1,234.56", "50%", "1/2", "3/4 cup", "½", "²", "x²+y³", "Ⅻ", "٣٤٥", "१२३", "１２３", "①②③", "12th", "1st 2nd 3rd",
        "a 1", "a  1", "a   1", " 1", "  1", "   1", "\t1", "\t\t1", "\n1", "\n\n1", "a\n\n12", " 12 ", "  0", "x  42y",
        "The year 2024 had 366 days", "Call 555-123-4567", "IP 192.168.0.1", "π ≈ 3.14", "99 bottles", "100", "1000000",
        "ten 10 twenty 20  thirty 30   forty 40", "1 2 3 4 5", "1  2  3", "1\t2\t3", "1\n2\n3", "１ ２", "  ①", "  ½", "  ²", "  Ⅻ", " \u00a01",
        "\u00a0\u00a01", "a\u30001", "a \u30001",
    ])
    add("contractions", [
        "it's", "don't", "you're", "we've", "I'm", "we'll", "he'd", "IT'S", "DON'T", "YOU'RE", "WE'VE", "I'M", "WE'LL", "HE'D",
        "It'S", "John's book", "JOHN'S BOOK", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'LL",
        "rock'n'roll", "o'clock", "y'all'd've", "'quoted'", "''", "'''", "’s", "it’s", "don’t", "'s's's", " 's", "  's", "1's", "'1",
    ])
    add("punct", [
        "!!!", "???", "...", "......", "?!?!", "---", "—", "–", "___", "***", "###", "===", "~~~", "<<<>>>", "(((", ")))", "[[]]",
        "{{}}", "«»", "“quotes”", "‘single’", "…", "•", "·", "§¶", "@@", "!!!\n\n", "?\n", ". . .", ",,,,", ";;", "::", "//", "\\\\",
        "|||", "&&", "^^", "%%", "$$", "##", "a!b?c.d,e", "a.b", "a. b", "a .b", " .", "  .", "  !", "a  !", "Hello ,world", "x : y",
    ])
    add("unicode", [
        "naïve café", "résumé", "Ünïcödé", "Ångström", "São Paulo", "Straße", "ﬁ ligature", "Ǆ", "İstanbul", "ǅ",
        "日本語", "こんにちは世界", "中文测试，标点符号。", "한국어 텍스트", "ไทย", "Ελληνικά", "Русский текст", "עברית",
        "العربية", "مرحبا بالعالم", "हिन्दी", "नमस्ते दुनिया", "தமிழ்", "বাংলা", "ქართული", "Հայերեն", "አማርኛ", "ᠮᠣᠩᠭᠣᠯ",
        "🙂", "🎉🙂!", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👩🏿‍💻", "🇺🇸🇯🇵", "❤️", "☺", "©®™", "1️⃣", "🫠", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝟘𝟙𝟚", "𐍈",
        "e\u0301", "a\u0300\u0301\u0302\u0303", "Z\u0351\u0352\u0353\u0354\u0355a\u0357\u0358l\u0359g\u035ao",
        "\u0915\u094d\u0937", "\u0627\u0644\u0633\u0651\u0644\u0627\u0645", "café" + "\u0301",
        "日本語 🙂", "mixed 中文 and English", "Ümlaut  äöü", "ﾊﾝｶｸ", "Ｆｕｌｌｗｉｄｔｈ", "\u2764\ufe0f", "\ufe0f", "\u200d",
        "\u200d\u200d", "🙂\u200d", "a\u200db", "\U0010ffff", "\U000e0001", "\ue000", "\uffff", "\ufffd", "\ufffe",
    ])
    add("control", [
        "\x00", "a\x00b", "\x00\x00\x00", "\x01\x02\x03", "\x1b[31mred\x1b[0m", "\x7f", "\x08\x08", "bell\x07", "\x1f", "\x9f",
        "\x80", "a\x85b", "\x00<|im_end|>", "tab\x00\tnul",
    ])
    add("special_text", [
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
        " <|im_start|>", "<|im_start|> ", "a<|im_end|>b", "a <|im_end|> b", "<|im_start|><|im_end|>", "<|im_end|><|im_end|>",
        "<|im_start", "<|im_start|", "|im_start|>", "<| im_start |>", "<|IM_START|>", "<|im_start|>>", "<<|im_start|>",
        "<|endoftext|>text<|endoftext|>", "<repo_name>x<file_sep>y", "<reponame>", "<filename>a.py", "<gh_stars>10",
        "<jupyter_code>print(1)<jupyter_output>1", "<empty_output>", "<issue_start><issue_comment><issue_closed>",
        "<jupyter_start><jupyter_text><jupyter_script>", "<s>", "</s>", "<unk>", "<pad>", "[INST]", "<|begin_of_text|>",
        "<|eot_id|>", "\n<|im_end|>\n", "  <|im_end|>  ", "<|im_end|>\n\n", "1<|im_end|>2", " 1<|im_end|> 2",
    ])
    add("long", [
        "a" * 1000, "ab" * 500, "Supercalifragilisticexpialidocious", "pneumonoultramicroscopicsilicovolcanoconiosis",
        "x" * 5000, "aaaa" + "b" * 3000 + "cccc", "1" * 2000, "😀" * 300, "日" * 1000, "é" * 500, " " * 1000, "\n" * 500,
        "\t" * 300, "a " * 1000, "word " * 400, "!" * 700, ("abc123" * 300), "https://" + "x" * 800 + ".com",
        "Lorem ipsum dolor sit amet. " * 100, "a\u0301" * 300,
    ])
    # combinations of preceding material
    pieces = ["it's", " 12", "  \n", "日本", "🙂", "<|im_end|>", "\t", "'S", "1,000", "é", "\r\n", "  "]
    for i, a in enumerate(pieces):
        for b in pieces[i:]:
            C.append(("combo", a + b))
    return C

CASES = _cases()

FUZZ_ALPHABET = (list("abcxyzABCXYZ0123456789 .,;:!?'\"-_()[]{}<>|/\\@#$%^&*+=~`") + [" ", "  ", "\t", "\n", "\r", "\r\n", "\x00", "\x0b",
                 "é", "ü", "ß", "日", "本", "語", "한", "ع", "ह", "\u0301", "\u200d", "🙂", "👍", "🏽", "🇺", "🇸", "\ufe0f", "\u00a0", "\u3000",
                 "½", "²", "٣", "１", "'s", "'S", "'ll", "'T", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "|>", "Ġ", "Ċ", "\U0001f468",
                 "\u2028", "\x85", "...", "---", "1,000", "3.14"])

def fuzz(n=2000, seed=20261207):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 40)
        out.append("".join(rng.choice(FUZZ_ALPHABET) for _ in range(k)))
    return out

if __name__ == "__main__":
    from collections import Counter
    print(len(CASES), Counter(c for c, _ in CASES))
    print(len(fuzz()))
