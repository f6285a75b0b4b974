"""Other engines than Python's jinja2, for the prompt an exported file carries: @huggingface/jinja (the template
engine of transformers.js; llama.cpp's own is a port of it) run by node, and Go's text/template as Ollama runs a
Modelfile's TEMPLATE. Each fixture skips, saying why, where its engine cannot be had."""

import json
import shutil
import subprocess

import pytest

HF_JINJA = "@huggingface/jinja@0.5.13"

RENDER_JS = """
import { readFileSync } from "node:fs";
import { Template } from "@huggingface/jinja";

const { template, cases } = JSON.parse(readFileSync(0, "utf8"));
const compiled = new Template(template);
const out = cases.map((messages) => compiled.render({ messages, add_generation_prompt: true, bos_token: "",
                                                      eos_token: "" }));
process.stdout.write(JSON.stringify(out));
"""

# Ollama reads a Modelfile's value byte by byte: a rune that strconv.IsPrint refuses is dropped unless it is a
# line break or a blank, and a value in triple quotes ends at the first blank after its closing quotes. Before
# a TEMPLATE that ranges over .Messages is run, consecutive messages of one role are joined by a blank line, and
# every system message, joined the same way, is .System.
RENDER_GO = r'''
package main

import (
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func templateValue(modelfile string) string {
	start := strings.Index(modelfile, "TEMPLATE ") + len("TEMPLATE ")
	var kept strings.Builder
	for _, r := range modelfile[start:] {
		blank := r == ' ' || r == '\t' || r == '\n' || r == '\r'
		value := strings.TrimSpace(kept.String())
		if blank && len(value) >= 6 && strings.HasPrefix(value, `"""`) && strings.HasSuffix(value, `"""`) {
			return value[3 : len(value)-3]
		}
		if blank || strconv.IsPrint(r) {
			kept.WriteRune(r)
		}
	}
	panic("the TEMPLATE value does not end")
}

func main() {
	var in struct {
		Modelfile string      `json:"modelfile"`
		Cases     [][]Message `json:"cases"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	tmpl := template.Must(template.New("").Option("missingkey=zero").Parse(templateValue(in.Modelfile)))
	out := []string{}
	for _, messages := range in.Cases {
		var system []string
		var joined []*Message
		for i := range messages {
			m := messages[i]
			if m.Role == "system" {
				system = append(system, m.Content)
			}
			if len(joined) > 0 && joined[len(joined)-1].Role == m.Role {
				joined[len(joined)-1].Content += "\n\n" + m.Content
			} else {
				joined = append(joined, &m)
			}
		}
		var b strings.Builder
		err := tmpl.Execute(&b, map[string]any{"System": strings.Join(system, "\n\n"), "Messages": joined,
			"Response": ""})
		if err != nil {
			panic(err)
		}
		out = append(out, b.String())
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
'''


@pytest.fixture(scope="session")
def hf_jinja(tmp_path_factory):
    """``render(template, cases)``: each case (a list of messages) rendered by @huggingface/jinja with
    add_generation_prompt, as transformers.js renders a chat template."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed: the chat template is not rendered by @huggingface/jinja")
    folder = tmp_path_factory.mktemp("hf-jinja")
    (folder / "package.json").write_text('{"type": "module", "private": true}\n')
    done = subprocess.run([npm, "install", "--prefer-offline", "--no-audit", "--no-fund", "--loglevel=error",
                           HF_JINJA], cwd=folder, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"npm install {HF_JINJA} failed: {(done.stderr or done.stdout).strip()[-300:]}")
    (folder / "render.mjs").write_text(RENDER_JS)

    def render(template, cases):
        out = subprocess.run([node, "render.mjs"], cwd=folder, input=json.dumps({"template": template,
                             "cases": cases}), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    return render


@pytest.fixture(scope="session")
def ollama_go(tmp_path_factory):
    """``render(modelfile, cases)``: the TEMPLATE of a Modelfile, read and run on each case (a list of messages)
    by Go's text/template as Ollama does."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed: the Modelfile's TEMPLATE is not run by Go's text/template")
    folder = tmp_path_factory.mktemp("ollama-go")
    (folder / "render.go").write_text(RENDER_GO)
    built = subprocess.run([go, "build", "-o", "render", "render.go"], cwd=folder, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr

    def render(modelfile, cases):
        out = subprocess.run([str(folder / "render")], input=json.dumps({"modelfile": modelfile, "cases": cases}),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    return render
